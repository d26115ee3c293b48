"""The KV handoff's bookkeeping: the ``ledger`` of every handoff from prefill's answer until decode's
answer begins (or not), and the lease ``guard`` that judges whether decode's answer may rest on KV
prefill had already released. The pool's state owns the ledger; a request's plan is the only writer of
its own handoff there."""
