"""NVML numbers devices physically; torch only the visible ones: the mapping between them."""

from __future__ import annotations

import pytest

from autospec.telemetry import nvml_device_ref, nvml_handle


@pytest.mark.parametrize("index, visible, want", [
    (0, None, 0),
    (1, None, 1),
    (0, "2,3", 2),
    (1, "2, 3", 3),
    (0, "GPU-8d2f", "GPU-8d2f"),
    (1, "1,MIG-4b1c0f2e-aaaa", "MIG-4b1c0f2e-aaaa"),
    (0, "3,-1,0", 3),
])
def test_torch_index_to_nvml(index, visible, want):
    assert nvml_device_ref(index, visible) == want


@pytest.mark.parametrize("index, visible", [(2, "2,3"), (1, "3,-1,0"), (0, ""), (1, "0,,1")])
def test_an_index_past_the_visible_list_is_an_error(index, visible):
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        nvml_device_ref(index, visible)


class StandInNvml:
    """The three NVML calls the mapping makes, over four devices with these UUIDs."""

    uuids = ["GPU-aaaa1111", "GPU-bbbb2222", "GPU-bbbb3333", "GPU-cccc4444"]

    def nvmlDeviceGetCount(self):
        return len(self.uuids)

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("handle", i)

    def nvmlDeviceGetUUID(self, handle):
        return self.uuids[handle[1]].encode()

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if uuid not in self.uuids:
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        return ("handle", self.uuids.index(uuid))


def test_handles_follow_cuda_visible_devices():
    nvml = StandInNvml()
    assert nvml_handle(nvml, 0, visible="3,1") == ("handle", 3)
    assert nvml_handle(nvml, 1, visible="3,1") == ("handle", 1)
    assert nvml_handle(nvml, 0) == ("handle", 0)
    assert nvml_handle(nvml, 0, visible="GPU-cccc4444") == ("handle", 3)
    assert nvml_handle(nvml, 0, visible="bbbb3") == ("handle", 2)  # a unique prefix
    with pytest.raises(ValueError, match="matches 2"):
        nvml_handle(nvml, 0, visible="GPU-bbbb")
    # torch's UUID for the device wins over the list (and over CUDA_DEVICE_ORDER)
    assert nvml_handle(nvml, 0, uuid="bbbb2222", visible="0") == ("handle", 1)
    assert nvml_handle(nvml, 0, uuid="dddd", visible="2") == ("handle", 2)  # unknown: the list
