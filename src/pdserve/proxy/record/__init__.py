"""What a request leaves behind and what its client is told: its walk-through for /requests
(``record``), where its time went and the histograms /metrics serves (``timeline``), its OpenTelemetry
spans (``otel``), and the response writer that keeps what the client was told went wrong
(``responder``). Records are written by a request's plan (request/plan.py) and read by no decision."""
