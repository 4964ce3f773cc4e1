"""The serving core: the data plane (``dataplane``), one serving unit per model version (``unit``:
its ``queue``, ``admission`` policy and ``executor``), the registry of versions (``registry``),
their lifecycle (``lifecycle``), model control (``control``), a worker's models from start to
stop (``boot``), the interfaces to sibling workers and the process (``siblings``) and the
hung-inference ``watchdog``."""
