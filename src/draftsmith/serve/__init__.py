"""`draftsmith serve`: an OpenAI-compatible HTTP server that decodes speculatively.

app.py (routes and formats), protocol.py (request checks, error bodies), scheduler.py (bounded queue, one worker
interleaving requests round by round), text.py (incremental detokenisation, stop strings), metrics.py (Prometheus
text), server.py (load, bind, run), process.py (run it as a child process for benchmarks and tests).
"""
