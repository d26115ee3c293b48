"""The instances and who serves next: ``state`` (``ProxyState``, the owner of the pools, membership,
counters and recent traces), each ``instance``'s lifecycle and ``breaker``, active ``health`` checks,
the routing ``policies`` (``routing``, ``prefix``) and the ``choice`` among instances in service, the
elastic pool's router (``elastic``), its ``holding`` and ``calibrator``, Kubernetes ``discovery``
(``k8s_watch``), the ``models`` instances serve, and the ``warmup`` of a returning instance. Nothing
here knows a request's path."""
