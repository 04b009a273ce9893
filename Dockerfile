# tracereplay: the Locust master, its workers and `replay sim` all run from this one image.
#   docker build -t tracereplay .
#   docker run --rm -p 8089:8089 tracereplay --replay-config configs/demo.yaml   # web UI (needs a `sim`)
#   docker run --rm --entrypoint replay tracereplay trace stats replay/data/sample_trace.jsonl
# docker-compose.yml wires master, workers and targets together; see docs/deployment.md.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# The package, its entry points and the bundled sample trace (replay/data/).
COPY pyproject.toml README.md locustfile.py ./
COPY replay ./replay
COPY configs ./configs
# The toy tokenizer is the project's own, identical in every container built from this file
# (training is deterministic), so sim and workers agree on token counts with nothing in ./data.
# uid 1000: files written to the ./data bind mount belong to the usual first host user.
# compileall: the entry point imports `replay` from /app, not site-packages, and with
# PYTHONDONTWRITEBYTECODE every master and worker would compile it again at each start.
RUN pip install . \
    && python -m compileall -q /app/replay /app/locustfile.py \
    && python -m replay.locust_help \
    && python -c "from replay.synth.toy import build_toy_tokenizer; build_toy_tokenizer('/opt/tracereplay/toy-tokenizer')" \
    && useradd --create-home --uid 1000 --user-group replay \
    && mkdir -p /app/data/results \
    && chown -R replay:replay /app/data

USER replay

# 8089: Locust's web UI (master); 5557: where workers reach the master.
EXPOSE 8089 5557

ENTRYPOINT ["locust", "-f", "/app/locustfile.py"]
CMD ["--help"]
