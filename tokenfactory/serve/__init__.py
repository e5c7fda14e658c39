"""`tokenfactory serve`: the composition root. Flags, the engine or fleet started, the meter, ledger, tenancy
and the HTTP app wired together; nothing here is imported by the layers below."""
