"""The plugin's own counters in Prometheus text format (``render``) on an endpoint of its own (``server``), and the
drafter's size gauges sampled on the drafting thread (``drafter``). Never imports vLLM (CPU-tested); docs/metrics.md
says what each metric means and what to do when it moves."""
