# CPU image (XLA:CPU, the embedded default):
#   docker build -t neurontrain .
#   docker run --rm neurontrain            # runs the tiny BERT recipe end to end
# g++ is there for --backend native: inductor compiles C++ for the CPU.
# Neuron image: build on an AWS Neuron PyTorch training deep-learning container, which already carries
# torch-neuronx, neuronx-cc and the Neuron runtime; torch and torch-xla are then left as the DLC has them:
#   docker build --build-arg BASE_IMAGE=<Neuron DLC: pytorch-training-neuronx, PyTorch 2.9> \
#                --build-arg NEURON=1 -t neurontrain:neuron .
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG NEURON=0
WORKDIR /opt/neurontrain
COPY pyproject.toml README.md constraints.txt ./
COPY neurontrain ./neurontrain
COPY recipes ./recipes
RUN if [ "$NEURON" = "1" ]; then \
        pip install --no-cache-dir --extra-index-url https://pip.repos.neuron.amazonaws.com . ; \
    else \
        apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/* && \
        pip install --no-cache-dir uv && uv pip install --system --no-cache -c constraints.txt . ; \
    fi && mkdir -p compile_cache
ENTRYPOINT ["neurontrain"]
CMD ["run", "recipes/tiny-bert-classification.yaml", "--output-dir", "/tmp/neurontrain-run"]
