# An S3-compatible store for the fleet compose in CI: moto's server, from PyPI, on the Debian
# base (the CA bundle and pip configuration of docker/build-extra, as tierd's image takes them).
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY docker/build-extra/ /tmp/build-extra/
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && if [ -f /tmp/build-extra/ca.crt ]; then cp /tmp/build-extra/ca.crt /etc/ssl/certs/ca-certificates.crt; fi \
 && if [ -f /tmp/build-extra/pip.conf ]; then cp /tmp/build-extra/pip.conf /etc/pip.conf; fi \
 && python3 -m venv /opt/moto \
 && PIP_CERT=/etc/ssl/certs/ca-certificates.crt /opt/moto/bin/pip install "moto[server]>=5.1" \
 && rm -f /etc/pip.conf
EXPOSE 5000
ENTRYPOINT ["/opt/moto/bin/moto_server", "-H", "0.0.0.0", "-p", "5000"]
