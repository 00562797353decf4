"""The driver process: CLI, job spec, Ray placement, scheduler, tokenizer, writer. Imports no MindSpore."""
