# An agent image for simulated GPU hosts: node-agent (and gpucp-shim), /bin/sh and /bin/sleep
# for the jobs to run, the topology files of node-agent/topologies in
# /usr/share/gpu-node-agent/topologies, and the shared libraries all of them link.
# build-image.sh prepares the context (no base image is pulled).
FROM scratch
COPY rootfs/ /
EXPOSE 7100
VOLUME ["/var/lib/gpu-node-agent"]
ENTRYPOINT ["/usr/local/bin/node-agent"]
