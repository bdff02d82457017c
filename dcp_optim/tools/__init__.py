"""Tools built on the drop-in API, for checkpoints on disk and adoption.

* ``cli``          ``python -m dcp_optim``: inspect, diff, plan and convert
* ``checkpoint``   ``Checkpoint``: what a DCP checkpoint holds, read safely
                   (``_safe_unpickle``: the restricted unpickler it uses)
* ``convert``      nested <-> flat optimizer layout, in memory and on disk
                   (``dcp_optim.convert``)
* ``verify``       checksums of model and optimizer state, checked after a
                   load (``dcp_optim.verify``)
* ``planner``      ``LoadPlanner``: a DCP load planner tolerating empty
                   param-group keys across layouts
* ``demo``         the code of ``python -m dcp_optim.demo``

``dcp_optim`` re-exports the public names: ``dcp_optim.convert``,
``dcp_optim.verify``, ``dcp_optim.Checkpoint``, ``dcp_optim.LoadPlanner``.
"""
