"""``mimw bench trace``: replay request traces (agent sessions, Mooncake rows) against the engine or a server.

readers (trace files -> format.Trace) -> tokens (prompts from hash ids) -> replay (in-process engine) or remote
(HTTP) -> report (summaries, JSON, markdown, chart); synth writes synthetic agent traces; main is the command line.
"""
