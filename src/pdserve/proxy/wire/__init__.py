"""The wire: the proxy's one HTTP client, toward the instances and toward its sibling workers. ``client``
(pooled keep-alive HTTP/1.1 to one server, over TCP or a Unix socket) drives ``connection`` (a connection
per request in flight, on every token's path); ``failures`` is the one place where what they raise
becomes pdserve's; ``upstream`` is the client pointed at an instance, as the flow calls it."""
