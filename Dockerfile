# kvrouter image: the router, the relay (`kvrouter relay`) and the simulator (`kvrouter sim`) in one image.
#
# Stage 1 builds a wheel and installs it with its dependencies into /opt/venv; stage 2 copies only that venv
# onto a clean slim base, so no compiler, pip cache or source tree reaches the final image. The tiny local
# tokenizer (kvrouter.tinymodel) is built at image build time so the GPU-free `sim` stack needs no download.
#
#   docker build -t kvrouter .
#   docker run -p 8000:8000 -v $PWD/replicas.yaml:/etc/kvrouter/replicas.yaml:ro kvrouter
#   docker run kvrouter relay --replicas /etc/kvrouter/replicas.yaml --redis-url redis://redis:6379/0
#
# PYTHON_IMAGE is any Debian bookworm image with Python >= 3.11 as `python` and its venv module (the official
# python images; a plain Debian base with python3, python3-venv and python-is-python3, as .ci/build-image.sh makes).
# BUILD_PACKAGES names what such a base still needs to compile (Debian's python3: python3-dev for the headers).
# pip reads the PIP_* build arguments as its own settings, for an index other than PyPI:
#   docker build --build-arg PIP_INDEX_URL=https://pypi.example.internal/simple -t kvrouter .
# They exist in the build stage only, so none of them reaches the final image.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG BUILD_PACKAGES="" PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_CONSTRAINT PIP_TRUSTED_HOST PIP_CERT
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
# build-essential compiles kvrouter's own C extensions (the prefix index's tables, kvrouter/_blocktable.c, the
# block keys, kvrouter/_blockkeys.c, and kv_aware's cost refit, kvrouter/_costfit.c) and any dependency without a wheel for the platform; it never leaves this stage.
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential ${BUILD_PACKAGES} \
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
    && (cd / && python -c "import kvrouter._blockkeys, kvrouter._costfit; from kvrouter.blocktable import native_backend; native_backend()") \
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
# The build's output comes last: a new kvrouter build then reuses every layer above, which do not depend on it.
# (COPY writes as root whatever USER says: the venv stays read-only to the kvrouter user.)
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/kvrouter /opt/kvrouter
