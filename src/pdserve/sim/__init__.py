"""pdserve sim: vLLM-compatible engine instances (NixlConnector PD protocol) with modelled timing.

For scale, fault and routing-policy tests; real vLLM stays the proof that something works. Import what
you need from its modules (``sim.server`` to serve, ``sim.scheduler`` for the pure scheduler, ...): this
package loads nothing by itself, so importing the scheduler does not import the HTTP layer.
"""
