"""Config presets (YAML), installed as the package data ``portrl.configs``: device/, algorithm/, data/, model/."""
