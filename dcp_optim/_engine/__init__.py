"""The pipeline behind the drop-in API (private; no stable names).

``dcp_optim.state_dict`` validates a call and hands it to these modules, in
the order a get or a set runs:

* ``core``         loads the compiled core ``dcp_optim._dcp_optim`` and
                   builds the ``Context`` of torch objects it is handed
* ``checks``       option checks, argument normalisation and the cached
                   model walk (``walk``) every call starts from
* ``pipeline``     the load pipeline's interface (``LoadPart``: plan,
                   validate, move, commit)
* ``model``        model state dicts: get, and the model's ``LoadPart``
* ``optim``        optimizer state dicts: get (pristine state of
                   never-stepped parameters), init and the optimizers' ``LoadPart``
* ``pristine``     that pristine state, from the schema or a shadow step
* ``shadow``       the routes without a schema: the shadow step, upstream's
                   zero-gradient step undone, generic tensor copies
* ``fsdp1``        FSDP1 flat parameters: the optimizer's flat <-> original
                   mapping and its loads
* ``distribute``   DTensor routes: full loads, broadcasts and reshards
* ``collectives``  bucketed full gathers (``set_bucket_bytes``)
* ``consistency``  cross-rank agreement checks before any collective
* ``tree``         full-state / CPU-offload post-processing of a result
* ``checksums``    sharding-independent checksums (``dcp_optim.verify``,
                   ``StateDictOptions.verify_checksums``)

Nothing here imports ``dcp_optim.state_dict`` or ``dcp_optim.tools``
(tests/unit/test_import_graph.py).
"""
