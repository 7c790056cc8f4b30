"""Instance discovery: where the fleet's instances come from.

- ``static`` (default): the config's ``prefill``, ``decode`` and
  ``instances`` lists, fixed at start-up (plus whatever an operator adds or
  removes at run time through :meth:`pdgate.fleet.Fleet.add` / ``remove``).
- ``kubernetes``: :class:`pdgate.discovery.kubernetes.KubernetesDiscovery`
  watches pods selected by labels and adds/removes them as they become
  Ready / stop being Ready (``pip install 'pdgate[k8s]'``). Static instances
  stay.

:func:`start_discovery` is what the gateway app calls at start-up.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from pdgate.config import GatewayConfig
from pdgate.fleet import Fleet


class Discovery(Protocol):
    """A running discovery source; ``stop()`` ends it (idempotent)."""

    def stop(self) -> None: ...


def start_discovery(config: GatewayConfig, fleet: Fleet,
                    loop: asyncio.AbstractEventLoop | None = None) -> Discovery | None:
    """Start the configured discovery for ``fleet``; ``None`` for static lists.

    Args:
        config: the gateway config (``config.discovery``).
        fleet: the fleet to keep in sync.
        loop: the event loop that owns ``fleet`` (changes are applied there).

    Raises:
        ImportError: ``kubernetes`` discovery without the ``kubernetes`` package.
    """
    if config.discovery.type == "static":
        return None
    from pdgate.discovery.kubernetes import KubernetesDiscovery

    d = KubernetesDiscovery(config.discovery, fleet, loop=loop)
    d.start()
    return d


__all__ = ["Discovery", "start_discovery"]
