# syntax=docker/dockerfile:1
# pdserve's proxy, and the operator commands (verify, doctor, top, trace, k8s render), in one image:
#   make image       (scripts/image.sh: the right base, build args and tag)
#   docker build --build-arg VERSION=0.1.0 -t pdserve:0.1.0 .
# VERSION must be the package's version (pyproject.toml): the build fails otherwise, so the tag, the
# label and what `pdserve k8s render` names by default cannot drift apart. No vLLM in here: the engines
# run from their own images (docs/deploying.md).
ARG BASE=python:3.12-slim

FROM ${BASE} AS build
ARG VERSION
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
# The CA secret is there only when the builder passes one (--secret id=ca,src=…), for a host whose
# traffic passes a TLS-inspecting proxy; it is mounted for this step alone and is in no layer.
RUN --mount=type=secret,id=ca \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
 && python3 -m venv /opt/pdserve \
 && /opt/pdserve/bin/pip install -q ".[k8s]" \
 && /opt/pdserve/bin/pip uninstall -q -y pip setuptools \
 && built=$(/opt/pdserve/bin/python -c 'import importlib.metadata as m; print(m.version("pdserve"))') \
 && if [ "$built" != "$VERSION" ]; then \
        echo "VERSION=$VERSION but the package is pdserve $built: build with --build-arg VERSION=$built" >&2; \
        exit 1; \
    fi \
 && /opt/pdserve/bin/pdserve proxy --help >/dev/null

FROM ${BASE}
ARG VERSION
ARG REVISION=unknown
ARG SOURCE=unknown
LABEL org.opencontainers.image.title="pdserve" \
      org.opencontainers.image.description="pdserve proxy: prefill/decode disaggregated serving for vLLM" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="Apache-2.0"
# A numeric user, so Kubernetes' runAsNonRoot can check it without reading /etc/passwd.
RUN echo "pdserve:x:10001:10001:pdserve:/home/pdserve:/usr/sbin/nologin" >>/etc/passwd \
 && echo "pdserve:x:10001:" >>/etc/group \
 && mkdir -p /home/pdserve && chown 10001:10001 /home/pdserve
COPY --from=build /opt/pdserve /opt/pdserve
ENV PATH=/opt/pdserve/bin:$PATH PYTHONUNBUFFERED=1 HOME=/home/pdserve \
    PDSERVE_HEALTH_URL=http://127.0.0.1:8000/health
USER 10001:10001
WORKDIR /home/pdserve
EXPOSE 8000
# Healthy while the proxy can serve (at least one prefill and one decode instance); run with another
# --port, set PDSERVE_HEALTH_URL to match.
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['PDSERVE_HEALTH_URL'], timeout=2)"]
# In a container the proxy must listen beyond its own loopback; a later --host overrides this one.
# SIGTERM (docker stop, a pod's deletion) drains: in-flight requests finish, then it exits 0.
ENTRYPOINT ["pdserve", "proxy", "--host", "0.0.0.0"]
CMD ["--help"]
