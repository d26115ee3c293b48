"""The wire to the instances: the proxy's own HTTP/1.1 client (``connection``: a keep-alive connection
per request in flight, pooled per instance, on every token's path) and ``upstream``, the one place
where connection, OS and timeout errors become pdserve's."""
