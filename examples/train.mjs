// Train artifacts written by `gradbuilder export-web` (or `gradbuilder web-demo`) with
// onnxruntime-node:
//
//   npm install onnxruntime-node@1.30.0
//   node examples/train.mjs DIR [--data FILE] [--steps N] [--batch B] [--lr LR] [--out STATE] [--losses FILE]
//
// DATA (default DIR/data.safetensors): one tensor per input of the training graph, samples on
// the first axis; step i trains on rows [i*B mod n', i*B mod n' + B) with n' the samples in
// whole batches (the order Python's tests replay). --out writes the trained state
// (safetensors), --losses the losses (JSON); the model for inference goes to DIR/trained/.
import { mkdir, readFile, writeFile } from "node:fs/promises";
import { join } from "node:path";
import * as ort from "onnxruntime-node";
import { Trainer, parseSafetensors } from "../gradbuilder/web/gradbuilder-train.mjs";

const args = process.argv.slice(2);
const dir = args.find((a, i) => !a.startsWith("--") && !(args[i - 1] ?? "").startsWith("--"));
if (!dir) {
  console.error("usage: node examples/train.mjs DIR [--data FILE] [--steps N] [--batch B] [--lr LR] [--out STATE] [--losses FILE]");
  process.exit(2);
}
const option = (name, fallback) => {
  const i = args.indexOf(`--${name}`);
  return i >= 0 ? args[i + 1] : fallback;
};
const steps = Number(option("steps", 100));
const batch = Number(option("batch", 32));
const threads = Number(option("threads", 0));
const trainer = await Trainer.create(ort, dir, threads ? { sessionOptions: { intraOpNumThreads: threads } } : {});
if (option("lr")) trainer.setLearningRate(Number(option("lr")));
const data = parseSafetensors(new Uint8Array(await readFile(option("data", join(dir, "data.safetensors")))));

function rows(t, start, count) {
  const per = t.dims.slice(1).reduce((a, b) => a * b, 1);
  return new ort.Tensor(t.dtype, t.data.slice(start * per, (start + count) * per), [count, ...t.dims.slice(1)]);
}

const names = trainer.inputs.map((i) => i.name);
const n = data[names[0]].dims[0];
const whole = Math.floor(n / batch) * batch;
const losses = [];
const started = performance.now();
for (let i = 0; i < steps; i++) {
  const start = (i * batch) % whole;
  const feeds = Object.fromEntries(names.map((name) => [name, rows(data[name], start, batch)]));
  losses.push((await trainer.trainStep(feeds)).loss);
}
const seconds = (performance.now() - started) / 1000;
console.log(`loss ${losses[0].toFixed(4)} -> ${losses.at(-1).toFixed(4)} after ${steps} steps (${(steps / seconds).toFixed(1)} steps/s)`);
if (option("out")) await writeFile(option("out"), await trainer.saveState());
if (option("losses")) await writeFile(option("losses"), JSON.stringify({ losses, seconds, steps }));
const { model, data: weights, dataName } = await trainer.exportForInference();
await mkdir(join(dir, "trained"), { recursive: true });
await writeFile(join(dir, "trained", "inference_model.onnx"), model);
await writeFile(join(dir, "trained", dataName), weights);
console.log(`wrote ${join(dir, "trained", "inference_model.onnx")}`);
