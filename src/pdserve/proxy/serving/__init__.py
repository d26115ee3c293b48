"""The serving shell: ``create_app`` composes the parts (``app``, ``context``), the ``routes`` and the
``admin`` API, ``admission`` limits, the Prometheus ``exposition``, uvicorn's settings (``server``),
and the ways the proxy runs: on a thread of `pdserve up` (``thread``), or as worker processes on one
port (``workers``, ``worker``) that answer for each other (``peers``, ``peer_routes``)."""
