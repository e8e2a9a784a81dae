"""megacli serve: OpenAI's HTTP API on a checkpoint (app, protocol), continuous batching (batcher)
over a KV cache of independent sequences (slots), the job on every rank of a TP/PP layout (job)."""
