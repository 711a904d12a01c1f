"""The device: the one declared boundary to model compute (`port.DevicePort`), and its
in-process implementation (`inprocess`, the device thread); the Ray implementation lives
in `marlaas.distributed`. Which one a process uses is chosen above the pipeline
(`marlaas.backends`)."""

from marlaas.device.port import BASE, DevicePort, TokenCallback
from marlaas.device.records import DeviceFigures

__all__ = ["BASE", "DeviceFigures", "DevicePort", "TokenCallback"]
