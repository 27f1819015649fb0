"""mimw bench: the decode-step benchmark (``mimw bench decode``; see bench/README.md).

main (CLI) -> supervisor (child process per model, timeouts, restarts) -> worker (per context: inputs, reference,
then each backend from peers/: build, check, time) -> report / chart (JSON, markdown, PNG) -> readme (README table).
floor + bandwidth give the floor; fused gives the one shared weight set; inputs the shared step; check the gate;
timing the per-step CUDA-event medians.
"""
