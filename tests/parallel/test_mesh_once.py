"""The run's device mesh is built in one place (parallel/build.py `build_mesh`) and handed down: engines, the
pipeline and the transforms take sub-meshes of it, never build their own. Counted over the project's modules
(tests, benches and scripts excluded), lazy calls included."""
from __future__ import annotations

import ast
import os

from tests.test_layering import ROOT, project_files

MESH_BUILDERS = ("build_device_mesh", "init_device_mesh")


def mesh_build_sites(root: str = ROOT) -> list[str]:
    """Every call of a mesh builder in the project's modules, as "path:line name"."""
    sites = []
    for rel in project_files(root):
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=rel)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
                if name in MESH_BUILDERS:
                    sites.append(f"{rel}:{node.lineno} {name}")
    return sorted(sites)


def test_the_mesh_is_built_in_one_place():
    sites = mesh_build_sites()
    # parallel/mesh.py's build_device_mesh wraps torch's init_device_mesh; parallel/build.py calls it, once
    assert [s.split(":")[0] + " " + s.split()[-1] for s in sites] == [
        os.path.join("parallel", "build.py") + " build_device_mesh",
        os.path.join("parallel", "mesh.py") + " init_device_mesh"], sites


def test_the_count_sees_a_second_builder(tmp_path):
    (tmp_path / "parallel").mkdir()
    (tmp_path / "parallel" / "a.py").write_text("from parallel.mesh import build_device_mesh\n\n"
                                                "def f(layout):\n    return build_device_mesh(layout, 'cpu')\n")
    (tmp_path / "parallel" / "b.py").write_text("import torch.distributed.device_mesh as dm\n\n"
                                                "def g():\n    return dm.init_device_mesh('cpu', (2,))\n")
    assert mesh_build_sites(str(tmp_path)) == [os.path.join("parallel", "a.py") + ":4 build_device_mesh",
                                               os.path.join("parallel", "b.py") + ":4 init_device_mesh"]


def test_every_transform_named_in_order_is_applied_by_the_build():
    """ORDER drives the build: each name is a model transform, the data-parallel wrap or compile."""
    from parallel.build import MODEL_TRANSFORMS
    from parallel.transforms import ORDER
    assert set(ORDER) == set(MODEL_TRANSFORMS) | {"data_parallel", "compile"}
    assert ORDER.index("tensor_parallel") < ORDER.index("data_parallel") < ORDER.index("compile")
