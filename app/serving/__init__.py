"""The serving core: the data plane (``dataplane``), one serving unit per model version (``unit``:
its ``queue``, ``admission`` policy and ``executor``), the registry of versions (``registry``),
their lifecycle (``lifecycle``), the interface to sibling workers (``siblings``) and the
hung-inference ``watchdog``."""
