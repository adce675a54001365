"""The MaxText route: MaxText's own YAML files read as MaxText 0.2.5 reads them, mapped
onto the selector's typed Config, with the facts of what MaxText does with them.

- `files`: the base_config chain, overrides typed as YAML scalars, custom_mesh_and_rule,
  logical_axis_rules merged across the chain (and the limits on what is read).
- `axis_rules`: RoutedMoE's logical names resolved to mesh axes, as flax resolves them.
- `routing`: the routing each decoder family runs, mapped onto the block's knobs.
- `facts`: findings about what MaxText does with a config (measured or read in its source).
- `importer`: `from_maxtext`, which puts the above together, and `analyse_on_route`, the
  one fix search (`plan.analyse`) with each fix run in MaxText's keys (`maxtext_route`).
"""

from .files import MaxTextError
from .importer import MaxTextImport, analyse_on_route, from_maxtext, maxtext_route

__all__ = ["MaxTextError", "MaxTextImport", "analyse_on_route", "from_maxtext", "maxtext_route"]
