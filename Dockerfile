# kvrouter image: the router, the relay (`kvrouter relay`) and the simulator (`kvrouter sim`) in one image.
#
# Stage 1 builds a wheel and installs it with its dependencies into /opt/venv; stage 2 copies only that venv
# onto a clean slim base, so no compiler, pip cache or source tree reaches the final image. The tiny local
# tokenizer (kvrouter.tinymodel) is built at image build time so the GPU-free `sim` stack needs no download.
#
#   docker build -t kvrouter .
#   docker run -p 8000:8000 -v $PWD/replicas.yaml:/etc/kvrouter/replicas.yaml:ro kvrouter
#   docker run kvrouter relay --replicas /etc/kvrouter/replicas.yaml --redis-url redis://redis:6379/0

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
# build-essential compiles kvrouter's own C extension (the prefix index's tables, kvrouter/_blocktable.c) and
# any dependency without a wheel for the platform; it never leaves this stage.
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# Dependencies first, so a source-only change reuses the cached dependency layer.
COPY pyproject.toml README.md ./
RUN mkdir -p kvrouter && touch kvrouter/__init__.py \
    && pip install --upgrade pip wheel \
    && pip install . \
    && pip uninstall -y kvrouter
COPY setup.py ./
COPY kvrouter ./kvrouter
RUN pip install --no-deps . \
    && (cd / && python -c "import kvrouter._blockkeys; from kvrouter.blocktable import native_backend; native_backend()") \
    && KVROUTER_CACHE_DIR=/opt/kvrouter python -c "from kvrouter.tinymodel import ensure_tokenizer; ensure_tokenizer()"

FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="kvrouter" \
      org.opencontainers.image.description="KV-cache-aware OpenAI-compatible router for vLLM fleets" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 kvrouter \
    && useradd --system --uid 10001 --gid kvrouter --home-dir /home/kvrouter --create-home \
       --shell /usr/sbin/nologin kvrouter \
    && mkdir -p /etc/kvrouter \
    && chown kvrouter:kvrouter /etc/kvrouter
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/kvrouter /opt/kvrouter
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    KVROUTER_CACHE_DIR=/opt/kvrouter \
    KVROUTER_HOST=0.0.0.0 \
    KVROUTER_PORT=8000
USER 10001:10001
WORKDIR /home/kvrouter
EXPOSE 8000
# Liveness only: any HTTP answer from /health means the process serves (it answers 503 while no replica is
# routable, which a restart would not fix). The same check fits `kvrouter sim`; the relay serves no HTTP, so its
# deployments disable it. Orchestrators gate traffic on GET /ready (fleet known, prefix index loaded).
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, urllib.error, urllib.request\ntry:\n    urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('KVROUTER_PORT', '8000') + '/health', timeout=2)\nexcept urllib.error.HTTPError:\n    pass"]
ENTRYPOINT ["kvrouter"]
CMD ["--replicas", "/etc/kvrouter/replicas.yaml"]
