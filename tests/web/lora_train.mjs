// Train the web artifacts of a LoRA model (add_lora, export_web with the causal-LM loss) with
// gradbuilder-train.mjs's Trainer on onnxruntime-node, one batch per step, for Python to compare.
//
//   node tests/web/lora_train.mjs DIR BATCHES.safetensors STATE.safetensors LOSSES.json [--threads N]
//
// BATCHES holds each input of the training graph with a leading step axis: input_ids,
// attention_mask and labels [steps, B, L], each past input [steps, B, kv heads, 0, head size]
// (zero-length: nothing cached). Step i feeds entry i of each; STATE receives the trained state
// (saveState: the adapter, AdamW's moments, Step), LOSSES {losses, skipped, step}; DIR/trained/
// receives the model for inference with the trained adapter (exportForInference).
import { mkdir, readFile, writeFile } from "node:fs/promises";
import { join } from "node:path";
import * as ort from "onnxruntime-node";
import { Trainer, parseSafetensors } from "../../gradbuilder/web/gradbuilder-train.mjs";

const args = process.argv.slice(2);
const at = args.indexOf("--threads");
const threads = at >= 0 ? Number(args.splice(at, 2)[1]) : 0;
const [dir, batchesFile, stateFile, lossesFile] = args;
if (!lossesFile) {
  console.error("usage: node tests/web/lora_train.mjs DIR BATCHES.safetensors STATE.safetensors LOSSES.json [--threads N]");
  process.exit(2);
}
const trainer = await Trainer.create(ort, dir, threads ? { sessionOptions: { intraOpNumThreads: threads } } : {});
const batches = parseSafetensors(new Uint8Array(await readFile(batchesFile)));
const names = trainer.inputs.map((i) => i.name);
const missing = names.filter((n) => !(n in batches));
if (missing.length) throw new Error(`${batchesFile} has no tensors [${missing}] (the training graph's inputs)`);
const steps = batches[names[0]].dims[0];

/** Entry `i` of the leading axis of `t` as an ort.Tensor (a zero-length entry stays zero-length). */
function entry(t, i) {
  const dims = t.dims.slice(1);
  const per = dims.reduce((a, b) => a * b, 1);
  return new ort.Tensor(t.dtype, t.data.slice(i * per, (i + 1) * per), dims);
}

const losses = [];
for (let i = 0; i < steps; i++) {
  const { loss } = await trainer.trainStep(Object.fromEntries(names.map((n) => [n, entry(batches[n], i)])));
  losses.push(loss);
}
await writeFile(stateFile, await trainer.saveState());
await writeFile(lossesFile, JSON.stringify({ losses, skipped: trainer.skippedSteps, step: trainer.step }));
const { model, data, dataName } = await trainer.exportForInference();
await mkdir(join(dir, "trained"), { recursive: true });
await writeFile(join(dir, "trained", "inference_model.onnx"), model);
await writeFile(join(dir, "trained", dataName), data);
console.log(`loss ${losses[0]} -> ${losses.at(-1)} after ${steps} steps`);
