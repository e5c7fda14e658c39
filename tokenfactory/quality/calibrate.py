"""`tokenfactory quantize IN OUT --method gptq|awq --calibration FILE`: quantization calibrated on the user's own
prompts, by the field's library (llm-compressor, the `calibrate` extra: `pip install tokenfactory[calibrate]`),
written as a compressed-tensors folder that vLLM, SGLang, transformers and tokenfactory itself load.

    IN (anything we load)  -> a float32 Hugging Face copy in a temporary folder (models/hf_export.py)
                           -> transformers' model -> llm-compressor's oneshot: GPTQModifier or AWQModifier,
                              W{bits}A16 in groups of G (GPTQ symmetric, AWQ asymmetric by default), the LM
                              head left float as llm-compressor's recipes do; its own progress bars per layer
                           -> OUT/ config.json (quantization_config), model.safetensors, tokenizer files
                              OUT/calibration.json   what was done (CalibrationRecord)
                              OUT/heldout.jsonl      the file's prompts not calibrated on, for `tokenfactory eval`

The calibration file: JSON Lines with a "text", "prompt" or "messages" (a chat, rendered with the model's
template) field per line, or plain text whose paragraphs (blank-line separated) are the samples. The samples are
shuffled with `seed`; `num_samples` calibrate and the rest (at least a fifth of the file) are held out.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from tokenfactory.models.base import LoadedModel
from tokenfactory.types import MissingExtra, ParameterError

METHODS = ("gptq", "awq")
RECORD_FILE = "calibration.json"
HELDOUT_FILE = "heldout.jsonl"
MIN_HELDOUT_SHARE = 0.2
INSTALL_HINT = "pip install 'tokenfactory[calibrate]'  (llm-compressor)"


@dataclass(frozen=True)
class CalibrationSpec:
    method: str  # "gptq" | "awq"
    bits: int = 4
    group_size: int = 128  # inputs per scale; 0: one scale per output channel
    symmetric: bool | None = None  # None: the method's default (GPTQ symmetric, AWQ asymmetric)
    num_samples: int = 64
    seed: int = 0
    max_seq_len: int = 512
    awq_grid: int = 20  # AWQ's scale search: points tried per layer group (llm-compressor's n_grid, its default)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ParameterError("method", f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.bits not in (4, 8) or (self.method == "awq" and self.bits != 4):
            raise ParameterError("bits", f"bits must be 4 or 8 (AWQ: 4), got {self.bits}")
        if self.group_size not in (0, 32, 64, 128):
            raise ParameterError("group_size", f"group size must be 32, 64, 128 or 0 (per channel), got "
                                 f"{self.group_size}")
        if self.num_samples < 1 or self.max_seq_len < 8:
            raise ParameterError("num_samples", "num_samples must be >= 1 and max_seq_len >= 8")
        if self.awq_grid < 2:
            raise ParameterError("awq_grid", f"awq_grid must be >= 2, got {self.awq_grid}")

    @property
    def is_symmetric(self) -> bool:
        return self.symmetric if self.symmetric is not None else self.method == "gptq"

    @property
    def rtn_scheme(self) -> str | None:
        """Our round-to-nearest scheme of the same shape, for `tokenfactory eval`'s comparison (None: none is)."""
        if self.bits == 8:
            return "int8" if self.group_size == 0 else None
        return f"int4-g{self.group_size}" if self.group_size else None


@dataclass(frozen=True)
class CalibrationRecord:
    """OUT/calibration.json: enough to redo the run and to evaluate it on what it did not see."""

    source: str
    spec: dict
    calibration_file: str
    calibration_sha256: str
    num_samples_total: int
    calibration_ids: list[int]  # indices into the file's samples
    heldout_ids: list[int]
    library: str  # e.g. "llmcompressor 0.14.0.1"

    @staticmethod
    def read(folder: Path) -> CalibrationRecord | None:
        path = folder / RECORD_FILE
        return CalibrationRecord(**json.loads(path.read_text())) if path.is_file() else None


def read_calibration(path: Path, loaded: LoadedModel) -> list[str]:
    """The file's samples in file order (module docstring), chats rendered with the model's template."""
    if not path.is_file():
        raise FileNotFoundError(f"calibration file {str(path)!r} does not exist")
    raw = path.read_text(encoding="utf-8")
    if path.suffix != ".jsonl":
        samples = [p.strip() for p in raw.split("\n\n") if p.strip()]
    else:
        samples = []
        for number, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not valid JSON ({e.msg})") from None
            samples.append(_sample(record, loaded, f"{path}:{number}"))
    if len(samples) < 2:
        raise ValueError(f"{path}: {len(samples)} samples; calibration needs at least 2 (some are held out)")
    return samples


def _sample(record: object, loaded: LoadedModel, where: str) -> str:
    if isinstance(record, dict):
        for key in ("text", "prompt"):
            if isinstance(record.get(key), str):
                return record[key]
        if isinstance(record.get("messages"), list):
            return loaded.tokenizer.apply_chat_template(record["messages"], add_generation_prompt=False)
    raise ValueError(f"{where}: each line needs a string \"text\" or \"prompt\", or a \"messages\" list")


def split(num: int, num_samples: int, seed: int) -> tuple[list[int], list[int]]:
    """(calibration ids, held-out ids): shuffled with `seed`; at least MIN_HELDOUT_SHARE of the file held out."""
    order = list(range(num))
    random.Random(seed).shuffle(order)
    num_heldout = max(1, round(num * MIN_HELDOUT_SHARE))
    num_calibration = min(num_samples, num - num_heldout)
    return sorted(order[:num_calibration]), sorted(order[num_calibration:])


def check_group_size(loaded: LoadedModel, spec: CalibrationSpec) -> None:
    """Groups must divide every linear layer's inputs (llm-compressor says so only after the export and the
    model's load): SmolLM2's 576 take groups of 32 or 64, not 128."""
    if not spec.group_size:
        return
    cfg = loaded.config
    inputs = {"q/k/v/gate/up_proj": cfg.hidden_size, "o_proj": cfg.num_heads * cfg.head_dim,
              "down_proj": cfg.intermediate_size}
    for name, k in inputs.items():
        if k % spec.group_size:
            fits = [g for g in (32, 64, 128) if all(v % g == 0 for v in inputs.values())]
            raise ParameterError("group_size", f"group size {spec.group_size} does not divide the {k} inputs of "
                                 f"{name}; pick {' or '.join(map(str, fits)) or 'another size'} (or 0, one scale per "
                                 f"output channel)")


def _recipe(spec: CalibrationSpec) -> object:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = QuantizationArgs(num_bits=spec.bits, symmetric=spec.is_symmetric,
                               strategy="group" if spec.group_size else "channel",
                               group_size=spec.group_size or None)
    groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}
    if spec.method == "gptq":
        from llmcompressor.modifiers.quantization import GPTQModifier

        return GPTQModifier(config_groups=groups, ignore=["lm_head"])
    import torch
    from llmcompressor.modifiers.awq import AWQModifier
    from llmcompressor.pipelines import cache

    # llm-compressor 0.14's AWQ pins its cached calibration tensors for host-to-device copies; CPU-only torch cannot
    # pin memory, and without a device there is no copy to speed up.
    if not torch.accelerator.is_available():
        cache.IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    return AWQModifier(config_groups=groups, ignore=["lm_head"], n_grid=spec.awq_grid)


def calibrate(loaded: LoadedModel, spec: CalibrationSpec, calibration: Path, out: Path) -> CalibrationRecord:
    """Quantize `loaded` with llm-compressor on the calibration file's samples and write the folder `out`."""
    try:
        import llmcompressor
        from datasets import Dataset
        from llmcompressor import oneshot
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise MissingExtra(f"--method {spec.method} needs llm-compressor ({e.name} is missing): "
                           f"{INSTALL_HINT}") from None
    import torch

    from tokenfactory.models.hf_export import write_hf_folder

    check_group_size(loaded, spec)
    samples = read_calibration(calibration, loaded)
    calibration_ids, heldout_ids = split(len(samples), spec.num_samples, spec.seed)
    recipe = _recipe(spec)  # a bad combination fails before minutes of export
    with tempfile.TemporaryDirectory(prefix="tokenfactory-calibrate-") as tmp:
        base = write_hf_folder(loaded, Path(tmp) / "float", torch.float32)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(base)
        data = Dataset.from_dict({"text": [samples[i] for i in calibration_ids]}).map(
            lambda s: tokenizer(s["text"], truncation=True, max_length=spec.max_seq_len), remove_columns=["text"])
        oneshot(model=model, dataset=data, recipe=recipe, max_seq_length=spec.max_seq_len,
                num_calibration_samples=len(calibration_ids))
        model.save_pretrained(out, save_compressed=True)
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copy(base / name, out / name)  # ours, unchanged: the tokenizer is not what was quantized
    with (out / HELDOUT_FILE).open("w", encoding="utf-8") as f:
        for i in heldout_ids:
            f.write(json.dumps({"text": samples[i]}) + "\n")
    record = CalibrationRecord(
        source=str(loaded.path), spec=asdict(spec) | {"symmetric": spec.is_symmetric},
        calibration_file=str(calibration), calibration_sha256=hashlib.sha256(calibration.read_bytes()).hexdigest(),
        num_samples_total=len(samples), calibration_ids=calibration_ids, heldout_ids=heldout_ids,
        library=f"llmcompressor {llmcompressor.__version__}")
    (out / RECORD_FILE).write_text(json.dumps(asdict(record), indent=1))
    return record
