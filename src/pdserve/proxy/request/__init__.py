"""A request's path: ``flow`` parses it and performs the steps its ``plan`` names (typed in ``steps``),
the plan consulting the ``survivors``' rules and an elastic pool's ``placing``; ``prefill``, ``decode``
and ``release`` perform one step each; a broken stream goes on elsewhere (``migrate``, ``progress``,
``seam``); ``validation`` refuses up front what decode would, ``tokens`` counts a prompt, and
``wholeon`` reads the admin's request for one instance's whole answer."""
