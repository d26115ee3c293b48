"""The PD proxy: takes OpenAI requests, runs prefill then decode, relays decode's answer (``create_app`` in app.py)."""
