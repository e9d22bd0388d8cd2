# PostgreSQL 15 from Debian's packages, for the fleet compose in CI (no image registry needed):
# it takes postgres:15's POSTGRES_USER, POSTGRES_PASSWORD and POSTGRES_DB, and its healthcheck
# (pg_isready) works the same.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends postgresql-15 \
 && rm -rf /var/lib/apt/lists/*
COPY docker/ci/postgres-entrypoint.sh /usr/local/bin/postgres-entrypoint
RUN mkdir -p /var/run/postgresql /var/lib/postgresql/data \
 && chown postgres:postgres /var/run/postgresql /var/lib/postgresql/data
USER postgres
ENV PGDATA=/var/lib/postgresql/data PATH=/usr/lib/postgresql/15/bin:$PATH
EXPOSE 5432
ENTRYPOINT ["/bin/sh", "/usr/local/bin/postgres-entrypoint"]
