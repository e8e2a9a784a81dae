"""Decoding and scoring with a trained or converted checkpoint: ``runner`` loads it once and steps
it across TP/PP, ``sampling`` and ``beam`` choose tokens, ``scoring`` scores text, ``generator``
ties a tokenizer to them, ``job`` is the generate job's file I/O, ``lockstep`` runs rank 0's calls on
every rank (eval, serve), ``serve`` is the OpenAI-compatible HTTP server. Built on engine (models,
distributed, checkpoint); engine never imports it."""
