# syntax=docker/dockerfile:1
# One image for every KSB service (python -m services.<name>) and the Spark audit job (python -m ksb.spark).
# docker-compose.yml builds it once and runs each container with a different command.

# Spark's official Kafka source at pyspark's exact version, from Maven Central (the same pom `make` uses).
FROM maven:3.9-eclipse-temurin-17 AS spark-jars
WORKDIR /build
COPY infra/spark/pom.xml infra/spark/pom.xml
RUN mvn -q -B -f infra/spark/pom.xml dependency:copy-dependencies \
        -DincludeScope=runtime -DoutputDirectory=/opt/ksb/spark-jars

# bookworm pinned: it still ships openjdk-17, which pyspark 4 runs on.
FROM python:3.11-slim-bookworm
RUN apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless procps \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml ./
# The dependencies first, read from pyproject alone, so that a change to the code (or to README.md
# and LICENSE, which the package's metadata names) rebuilds the layers below in seconds instead of
# installing pyspark again (3.5 min here).
# Every extra but dev's: the services, the `ksb` CLI (security-init), Spark and faust.
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
o = p['optional-dependencies']; \
print('\n'.join(p['dependencies'] + o['services'] + o['cli'] + o['spark'] + o['faust']))" \
        > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt
COPY shared shared
COPY services services
# The order application (apps/orders.py): compose's client container and the order service the
# external activator starts, both on this image.
COPY apps apps
COPY README.md LICENSE ./
# Editable on purpose: the source tree is the working directory of activated tasks
# (python -m ksb.activation.activated) and of the reader commands the external activator starts.
RUN pip install --no-cache-dir --no-deps -e .
COPY infra infra
COPY --from=spark-jars /opt/ksb/spark-jars /opt/ksb/spark-jars
RUN useradd --create-home --uid 10001 ksb \
    && mkdir -p /var/lib/ksb/spark && chown -R ksb /var/lib/ksb
USER ksb
# No KSB_* variable here: each process refuses those its settings model does not read (the `ksb`
# CLI has no metrics port, a service no Spark jars), so docker-compose.yml gives each container
# exactly its own.
ENV PYTHONUNBUFFERED=1 \
    SPARK_HOME=/usr/local/lib/python3.11/site-packages/pyspark
EXPOSE 9100
CMD ["python", "-m", "services.dispatcher"]
