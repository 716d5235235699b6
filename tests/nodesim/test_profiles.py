"""Host profiles: bad ones are refused with the entry named."""

from __future__ import annotations

import pytest

from nodesim.profile import ProfileError, parse_profile

GOOD = {"bdf": "0000:01:00.0", "vendor": 0x10DE, "device": 0x2236, "class": 0x030200}


@pytest.mark.parametrize("data, message", [
    ([], "is a mapping"),
    ({"name": "x", "devices": [], "gpus": 1}, "unknown key(s) gpus"),
    ({"name": "", "devices": []}, "'name'"),
    ({"name": "x", "devices": [{**GOOD, "bdf": "01:00.0"}]}, "devices[0]: bdf '01:00.0'"),
    ({"name": "x", "devices": [{**GOOD, "vendor": "nvidia"}]}, "devices[0].vendor"),
    ({"name": "x", "devices": [GOOD, GOOD]}, "devices[1] repeats bdf 0000:01:00.0"),
    ({"name": "x", "devices": [{**GOOD, "parent": "0000:00:01.0"}]}, "parent 0000:00:01.0 is not a device"),
    ({"name": "x", "devices": [{k: v for k, v in GOOD.items() if k != "class"}]}, "missing 'class'"),
    ({"name": "x", "vfio_pci": "maybe", "devices": []}, "vfio_pci 'maybe'"),
    ({"name": "x", "devices": [{**GOOD, "bdf": "0000:01:00.0", "parent": "0000:02:00.0"},
                               {**GOOD, "bdf": "0000:02:00.0", "parent": "0000:01:00.0"}]}, "parent cycle"),
])
def test_bad_profiles_name_the_entry(data, message):
    with pytest.raises(ProfileError) as err:
        parse_profile(data, "p.yaml")
    assert message in str(err.value)
