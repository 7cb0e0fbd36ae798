"""Validate every KEDA ScaledObject in rendered manifests against the CRD schema vendored from KEDA's release.

Runs in the kube-tools venv (tests/test_deploy_kubernetes.py), whose jsonschema comes with kubernetes-validate.
The CRD's schema lets unknown fields through (the API server prunes them); here an unknown field is an error,
as `kubernetes-validate --strict` makes it for the built-in kinds, so a misspelt field cannot pass.
Usage: validate_scaledobjects.py SCHEMA.json RENDERED.yaml; prints one line per ScaledObject, exit 1 on errors.
"""

import json
import sys

import jsonschema
import yaml


def strict(schema):
    """The schema with additionalProperties: false wherever an object lists its properties and neither
    allows others (additionalProperties) nor keeps unknown fields (x-kubernetes-preserve-unknown-fields)."""
    if isinstance(schema, dict):
        schema = {key: strict(value) for key, value in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    return schema


def main(schema_path: str, rendered_path: str) -> int:
    with open(schema_path) as f:
        validator = jsonschema.Draft7Validator(strict(json.load(f)))
    failed = 0
    with open(rendered_path) as f:
        for doc in yaml.safe_load_all(f):
            if not doc or doc.get("kind") != "ScaledObject":
                continue
            name = f"scaledobject/{doc['metadata']['name']}"
            errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.path))
            for error in errors:
                path = ".".join(str(p) for p in error.path)
                print(f"ERROR {rendered_path} did not validate for resource {name} against KEDA v2.20.2: {path}: "
                      f"{error.message}")
            if not errors:
                print(f"INFO {rendered_path} passed for resource {name} against KEDA v2.20.2")
            failed += bool(errors)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
