// Validates every manifest in deploy/k8s against the Kubernetes API schemas
// (npm kubernetes-models) and checks the kustomization lists every file.
// Schemas catch wrong types, missing required fields and bad enums; they
// allow unknown fields, so yamllint + review cover typos.
// Usage: MHA_NODE_MODULES=.../node_modules node validate_k8s.mjs DIR
import { readFileSync, readdirSync } from "node:fs";
import { join } from "node:path";
import { createRequire } from "node:module";

const require = createRequire(join(process.env.MHA_NODE_MODULES, "x.js"));
const YAML = require("yaml");
const dir = process.argv[2];
let failures = 0;
let checked = 0;

// "apps/v1" + "Deployment" -> kubernetes-models/apps/v1/Deployment; core "v1" -> v1/...
function modelClass(apiVersion, kind) {
  return require(`kubernetes-models/${apiVersion}/${kind}`)[kind];
}

const files = readdirSync(dir).filter((f) => f.endsWith(".yaml")).sort();
for (const file of files) {
  const docs = YAML.parseAllDocuments(readFileSync(join(dir, file), "utf8"));
  for (const doc of docs) {
    if (doc.errors.length) { console.error(`${file}: ${doc.errors}`); failures++; continue; }
    const obj = doc.toJS();
    if (obj.kind === "Kustomization") {
      const missing = files.filter((f) => f !== file && !obj.resources.includes(f));
      if (missing.length) { console.error(`${file}: does not list ${missing}`); failures++; }
      continue;
    }
    try {
      const Model = modelClass(obj.apiVersion, obj.kind);
      new Model(obj).validate();
      checked++;
      console.log(`ok   ${file}: ${obj.apiVersion} ${obj.kind} ${obj.metadata.name}`);
    } catch (e) {
      console.error(`FAIL ${file}: ${obj.apiVersion} ${obj.kind}: ${e.message}`);
      failures++;
    }
  }
}
if (checked === 0) { console.error("no manifest checked"); failures++; }
process.exit(failures ? 1 : 0);
