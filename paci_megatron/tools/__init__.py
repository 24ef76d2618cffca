"""Tools around the library, each a ``python -m paci_megatron.tools.NAME`` command: text to a
Megatron dataset (``preprocess_data``), schedules compared on one config (``compare``, with
``tta`` and ``costs``), throughput and overhead benchmarks (``bench_throughput``,
``bench_overhead``), and the backward audit the reference tests use (``backward_audit``).
The library never imports them."""
