"""The PD proxy: takes OpenAI requests, runs prefill then decode, relays decode's answer."""

from pdserve.proxy.app import create_app

__all__ = ["create_app"]
