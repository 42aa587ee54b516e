"""Validate a CycloneDX 1.6 JSON file with cyclonedx-python-lib's strict JSON-schema validator.

Usage: python validate_cdx.py FILE   (exit 0 valid, 1 invalid, printing the first error)
"""
import sys

from cyclonedx.schema import SchemaVersion
from cyclonedx.validation.json import JsonStrictValidator

with open(sys.argv[1], encoding="utf-8") as f:
    text = f.read()
error = JsonStrictValidator(SchemaVersion.V1_6).validate_str(text)
if error is not None:
    print(f"{sys.argv[1]}: invalid CycloneDX 1.6: {str(error)[:300]}")
    sys.exit(1)
print(f"{sys.argv[1]}: valid CycloneDX 1.6")
