"""Model loading: GGUF files and Hugging Face folders, tokenizer and chat template, model code."""
