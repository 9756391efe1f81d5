"""`krnl serve`: an OpenAI-compatible HTTP server over the model (engine.py: batched decoding;
adapters.py: several adapters on one base; protocol.py and app.py: the API)."""
