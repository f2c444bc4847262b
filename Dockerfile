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
COPY pyproject.toml README.md ./
COPY shared shared
COPY services services
# Editable on purpose: devtools.runner.REPO_ROOT is the source tree, the working directory of activated
# tasks (python -m ksb.activation.activated) and of the service processes ksb starts.
RUN pip install --no-cache-dir -e '.[spark,faust]'
COPY infra infra
COPY --from=spark-jars /opt/ksb/spark-jars /opt/ksb/spark-jars
RUN useradd --create-home --uid 10001 ksb \
    && mkdir -p /var/lib/ksb/spark && chown -R ksb /var/lib/ksb
USER ksb
ENV PYTHONUNBUFFERED=1 \
    SPARK_HOME=/usr/local/lib/python3.11/site-packages/pyspark \
    KSB_SPARK_JARS=/opt/ksb/spark-jars \
    KSB_METRICS_PORT=9100 \
    KSB_METRICS_HOST=0.0.0.0
EXPOSE 9100
CMD ["python", "-m", "services.dispatcher"]
