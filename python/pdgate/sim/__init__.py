"""A vLLM-compatible instance simulator for routing experiments (``pdgate sim-fleet``).

* :mod:`pdgate.sim.profiles` — instance profiles (YAML data files with sources)
  and the step-time model.
* :mod:`pdgate.sim.blocks` — KV block pool with prefix caching.
* :mod:`pdgate.sim.scheduler` — vLLM V1-like continuous-batching scheduler.
* :mod:`pdgate.sim.engine` — the step loop on a scaled clock.
* :mod:`pdgate.sim.server` / :mod:`pdgate.sim.http` — the HTTP surface.
* :mod:`pdgate.sim.fleet` — many instances in one process.
"""

from pdgate.sim.fleet import SimFleet
from pdgate.sim.profiles import Profile, available_profiles, load_profile

__all__ = ["Profile", "SimFleet", "available_profiles", "load_profile"]
