"""Know before you run: a run's memory per device and phase, and its step's FLOPs, predicted from the config alone
(``portrl plan``), then measured against (docs/performance.md)."""
