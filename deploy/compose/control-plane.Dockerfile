# A replica image with nothing but the control-plane and gpuctl binaries and the shared
# libraries they link: build-image.sh prepares the context (no base image is pulled).
FROM scratch
COPY rootfs/ /
EXPOSE 7001
VOLUME ["/data"]
ENTRYPOINT ["/usr/local/bin/control-plane"]
