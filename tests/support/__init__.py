"""Plain helpers the test modules share (the pytest fixtures are in tests/conftest.py):

- paths: the repository and ../shared (`shared_path` skips, saying why, when it is absent)
- ports: `free_port`, safe when pytest-xdist runs test processes side by side
- traces: trace files and rows built by hand, damaged gzip files, slices of ../shared's trace
- records: records built by hand, the checks every real run's records must pass, the
  server-metrics file
- processes: real Locust processes (local, master and workers, web UI) and waiting for them
- waiting: polling with a deadline (`wait_for`), never sleeping and hoping
- deploy: the Dockerfile, paths in the image, Locust's parser for the deployments' commands
- dcgm: a fake NVIDIA dcgm-exporter serving a page in its format (data/dcgm-exporter.txt)
- kustomize: `kubectl kustomize`, the build `kubectl apply -k` applies (skips without kubectl)
- browser: Chromium's flags, and `need` for optional tools (fails in CI, skips elsewhere)
- vllm: real vLLM on CPU: a tiny model folder around a real tokenizer, and its server process
- hf_cache: a Hugging Face hub cache laid out by hand (blobs, symlinked snapshots, refs)
"""
