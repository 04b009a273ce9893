# tracereplay: the Locust master, its workers and `replay sim` all run from this one image.
#   docker build -t tracereplay .
#   docker run --rm -p 8089:8089 tracereplay --replay-config configs/demo.yaml   # `replay run ...`: web UI (needs a `sim`)
#   docker run --rm --entrypoint replay tracereplay trace stats replay/data/sample_trace.jsonl
# docker-compose.yml wires master, workers and targets together; see docs/deployment.md.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# The package, its entry points, its locustfile and the bundled sample trace (replay/data/),
# installed into site-packages; /app keeps the sources for the relative paths of configs/.
COPY pyproject.toml README.md ./
COPY replay ./replay
COPY configs ./configs
# The toy tokenizer is the project's own, identical in every container built from this file
# (training is deterministic), so sim and workers agree on token counts with nothing in ./data.
# uid 1000: files written to the ./data bind mount belong to the usual first host user.
# The entry points import `replay` from site-packages, which pip compiled at install (with
# PYTHONDONTWRITEBYTECODE nothing is compiled at a start).
RUN pip install . \
    && python -c "from replay.synth.toy import build_toy_tokenizer; build_toy_tokenizer('/opt/tracereplay/toy-tokenizer')" \
    && useradd --create-home --uid 1000 --user-group replay \
    && mkdir -p /app/data/results \
    && chown -R replay:replay /app/data

USER replay

# 8089: Locust's web UI (master); 5557: where workers reach the master.
EXPOSE 8089 5557

# `replay run`: Locust with the package's locustfile; its --help lists Locust's and the replay's options.
ENTRYPOINT ["replay", "run"]
CMD ["--help"]
