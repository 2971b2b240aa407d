"""What the host can give: available RAM (controller.probes.host, psutil) and GPU memory (controller.probes.gpu,
NVML, optional). This package's own import loads nothing."""
