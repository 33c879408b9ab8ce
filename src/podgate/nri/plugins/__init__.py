"""NRI plugins built on `podgate.nri.plugin`; run one with `python -m podgate.nri.plugins.NAME`."""
