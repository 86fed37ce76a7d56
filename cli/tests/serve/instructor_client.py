"""Asks a maxc server for Pydantic models through `instructor` (run by test_structured.py with
instructor's own packages on PYTHONPATH). Prints one JSON line per answer."""

import json
import sys
from typing import Literal

import instructor
import openai
from pydantic import BaseModel, Field


class Address(BaseModel):
    city: Literal["Paris", "Tokyo", "Lima"]
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    address: Address
    hobbies: list[Literal["chess", "music", "running"]] = Field(max_length=3)


def main():
    base = sys.argv[1]
    client = instructor.from_openai(openai.OpenAI(base_url=base, api_key="none"),
                                    mode=instructor.Mode.JSON_SCHEMA)
    for seed in range(int(sys.argv[2])):
        p = client.chat.completions.create(
            model=sys.argv[3], response_model=Person, max_retries=0, temperature=1.0,
            seed=seed, max_tokens=200,
            messages=[{"role": "user", "content": "Describe a person."}])
        print(json.dumps(p.model_dump()), flush=True)


if __name__ == "__main__":
    main()
